"""llama.cpp as a test oracle: its bindings, or a skip that says why they cannot be used."""

import pytest


def import_llama_cpp():
    """The `llama_cpp` module; skips (the calling test, or the module when called at its top) when
    llama-cpp-python is not installed, or is installed without a library it can load (bindings
    built with LLAMA_BUILD=OFF and no LLAMA_CPP_LIB_PATH)."""
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama-cpp-python is not installed (../shared/peers.md)", allow_module_level=True)
    except OSError as e:
        pytest.skip(f"llama-cpp-python is installed but its library did not load ({e}); "
                    "set LLAMA_CPP_LIB_PATH to a llama.cpp build", allow_module_level=True)
    return llama_cpp
