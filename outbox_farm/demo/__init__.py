"""`outbox-farm demo`: a throwaway farm on an embedded server (`run`) with a sample app (`app`)."""
