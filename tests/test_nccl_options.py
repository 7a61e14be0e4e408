"""`parallel.nccl_communicator_config_path`: a bad file is refused at config time in one line naming the key, a good
one reaches megatron-core's `initialize_model_parallel`, and a gloo run refuses it before building any group."""

from __future__ import annotations

import pytest

from parallel import initialize
from pretrain.config import ConfigError
from pretrain.config.schema import ParallelConfig
from tests.config_helpers import tiny

KEY = "parallel.nccl_communicator_config_path"
SHIPPED = "configs/nccl/dp_reduce_4ctas.yaml"


@pytest.mark.parametrize("text, says", [
    ("dp: {max_ctas: 0}", "dp.max_ctas must be an integer >= 1"),
    ("dp: {max_ctas: four}", "dp.max_ctas must be an integer >= 1"),
    ("data_parallel: {max_ctas: 4}", "unknown process group 'data_parallel'"),
    ("dp: {max_blocks: 4}", "dp.max_blocks is not an NCCL option"),
    ("dp: {net_name: tcp}", "dp.net_name must be ib or socket"),
    ("dp: 4", "dp must map option names"),
    ("- dp", "must map process-group names"),
    ("dp: [", "is not YAML"),
])
def test_bad_nccl_options_are_refused_naming_the_key(tmp_path, text, says):
    path = tmp_path / "nccl.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        tiny(f"{KEY}={path}")
    message = str(e.value)
    assert message.startswith(KEY) and says in message and "\n" not in message


def test_missing_file_is_refused():
    with pytest.raises(ConfigError, match=f"{KEY}: no file"):
        tiny(f"{KEY}=configs/nccl/none.yaml")


def test_shipped_file_validates_and_reaches_megatron(monkeypatch):
    cfg = tiny(f"{KEY}={SHIPPED}")
    seen = {}
    from megatron.core import parallel_state as ps

    monkeypatch.setattr(initialize, "init_distributed", lambda *a, **k: None)
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(ps, "initialize_model_parallel", lambda **kw: seen.update(kw))
    monkeypatch.setattr(initialize, "model_parallel_cuda_manual_seed", lambda seed: None, raising=False)
    monkeypatch.setattr(initialize.torch.cuda, "is_available", lambda: True)
    import megatron.core.tensor_parallel as mtp

    monkeypatch.setattr(mtp, "model_parallel_cuda_manual_seed", lambda seed: None)
    initialize.initialize_parallel(cfg.parallel)
    assert seen["nccl_communicator_config_path"] == SHIPPED


def test_gloo_run_refuses_nccl_options(monkeypatch):
    monkeypatch.setattr(initialize.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=f"{KEY}=.*no CUDA"):
        initialize.nccl_options_path(ParallelConfig(nccl_communicator_config_path=SHIPPED))
    assert initialize.nccl_options_path(ParallelConfig()) is None
