"""jinja2 templates of everything edgeq writes into a bundle that lands on a device."""
