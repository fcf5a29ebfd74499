"""Thin command line over the hybridpar packages."""
