"""Remote tier (Redis/Valkey) shared by several hosts."""
