"""`python -m hkv store ...`: the disk tier's command line (`hkv.store.cli`)."""

from hkv.store.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
