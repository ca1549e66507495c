import pytest

from models import family_config


def micro(family: str = "gpt2", **switches):
    """A 2-layer, d=32 model config: builds and runs in milliseconds."""
    return family_config(
        family, n_layer=2, n_head=4, d_model=32, d_ff=64, context=24, vocab_size=97, **switches
    )


@pytest.fixture
def micro_config():
    return micro
