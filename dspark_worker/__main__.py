"""``python -m dspark_worker``: the same program as the ``dspark-worker`` command."""

from .cli import main

if __name__ == "__main__":
    main()
