import os
import sys

# tests import the flat modules from the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: first run converts SmolLM2 GGUF")
