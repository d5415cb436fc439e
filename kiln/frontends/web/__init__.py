"""The web dashboard (/dashboard): a page, its static files, and the JSON it polls."""
