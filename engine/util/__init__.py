"""Small leaf helpers every engine layer may use (no engine imports): `sizes` (byte sizes people write)."""
