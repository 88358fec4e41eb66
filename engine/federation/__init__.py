"""Transports that move a method's payloads between the server half and the site halves."""
