"""What keeps tenants apart beyond their records: salted engine caches and per-tenant limits
(docs/security.md)."""
