"""`python -m megatron_bridge.train`: see runner.py."""

from megatron_bridge.train.runner import main

if __name__ == "__main__":
    main()
