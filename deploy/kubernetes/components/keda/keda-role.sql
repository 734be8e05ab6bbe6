-- The role KEDA's queries run as (components/keda): it may read the outbox table, nothing else.
-- Run once, as the table's owner (or a role that may create roles), with psql:
--
--   psql "$OWNER_DSN" -f deploy/kubernetes/components/keda/keda-role.sql
--   psql "$OWNER_DSN" -c '\password outbox_farm_keda'
--
-- (\password sends the password hashed, so it shows in no log.) Name the table as the farm does
-- if it is not `public.outbox`, and grant CONNECT on the database too if you revoked it from
-- PUBLIC. Every session of the role is read-only as well: a write fails even if a privilege is
-- granted by mistake later.
CREATE ROLE outbox_farm_keda LOGIN;
ALTER ROLE outbox_farm_keda SET default_transaction_read_only = on;
GRANT USAGE ON SCHEMA public TO outbox_farm_keda;
GRANT SELECT ON TABLE public.outbox TO outbox_farm_keda;
