"""Prefix caching: chained keys of full pages of tokens, and the cache that
finds a new prompt's pages and keeps committed ones findable (S1-S16)."""
