"""The app the README's "Testing your handlers" examples import (`myapp.outbox`)."""
