import pytest

from hf_models import save_tiny


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h"])
def checkpoint(request, tmp_path_factory):
    """(HF model, its directory): a tiny checkpoint of each kind, EOS off so generate runs on."""
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    hf.generation_config.eos_token_id = None
    return hf, path
