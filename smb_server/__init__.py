"""Soft Memory Box servers: the controller and the memory server."""
