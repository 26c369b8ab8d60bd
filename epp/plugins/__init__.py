"""Built-in scheduling plugins, one module each; ``registry`` is the one place they are named."""
