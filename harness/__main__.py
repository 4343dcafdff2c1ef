from harness.cli import main

# guarded: a worker that write_random_gguf spawns imports this module again (as __mp_main__)
if __name__ == "__main__":
    raise SystemExit(main())
