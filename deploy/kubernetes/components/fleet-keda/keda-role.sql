-- The role KEDA's query runs as with a fleet (components/fleet-keda): it may read the catalog
-- table of the fleet's home database, nothing else. Run once on the home database, as the
-- table's owner (or a role that may create roles), with psql:
--
--   psql "$HOME_OWNER_DSN" -f deploy/kubernetes/components/fleet-keda/keda-role.sql
--   psql "$HOME_OWNER_DSN" -c '\password outbox_farm_keda'
--
-- (in place of ../keda/keda-role.sql, which grants the single farm's outbox table instead).
-- Name the table as your catalog does if it is not `public.tenants`. Every session of the role
-- is read-only as well: a write fails even if a privilege is granted by mistake later.
CREATE ROLE outbox_farm_keda LOGIN;
ALTER ROLE outbox_farm_keda SET default_transaction_read_only = on;
GRANT USAGE ON SCHEMA public TO outbox_farm_keda;
GRANT SELECT ON TABLE public.tenants TO outbox_farm_keda;
