"""frontend layer."""
