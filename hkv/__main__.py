"""`python -m hkv ...`: the `hkv` command line (`hkv.serve.cli`: serve, generate, store)."""

from hkv.serve.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
