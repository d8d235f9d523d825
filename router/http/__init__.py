"""The HTTP edge: the app, its routes, authentication and what goes back to clients."""
