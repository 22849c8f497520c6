"""How a model splits across tensor-parallel ranks, and the splits refused (each error names the numbers)."""
from __future__ import annotations

import pytest
from tiny_models import build_tiny_checkpoint

from appliance.config import Config
from appliance.errors import ConfigError
from appliance.model_zoo.config import ModelConfig


def _config(heads: int = 32, kv: int = 8, intermediate: int = 14336, vocab: int = 128256) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": 4096,
                                  "intermediate_size": intermediate, "num_hidden_layers": 32,
                                  "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128})


def test_a_rank_holds_its_share_and_the_whole_stays_known():
    cfg = _config(heads=28, kv=4, vocab=152065)
    part = cfg.sharded(2)
    assert (part.num_heads, part.num_kv_heads, part.intermediate_size, part.tp_size) == (14, 2, 7168, 2)
    assert part.unsharded is cfg and part.sharded(2) is part and part.sharded(1) == cfg
    assert [part.kv_head_start(r) for r in range(2)] == [0, 2]
    assert part.vocab_per_rank == 76033  # the last rank's row past the vocabulary is padding
    assert cfg.sharded(1) is cfg


def test_fewer_kv_heads_than_ranks_are_replicated_where_the_ranks_share_them_evenly():
    part = _config(heads=32, kv=2).sharded(8)
    assert (part.num_heads, part.num_kv_heads) == (4, 1)
    # ranks 0-3 read KV head 0, ranks 4-7 KV head 1: each rank's 4 query heads are in that head's group of 16
    assert [part.kv_head_start(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("shape,tp,words", [
    (dict(heads=28, kv=4), 8, "num_attention_heads=28 is not divisible by 8"),
    (dict(heads=24, kv=6), 4, "num_key_value_heads=6 is not divisible by 4"),
    (dict(heads=30, kv=3), 6, "intermediate_size=14336 is not divisible by 6"),
    (dict(heads=24, kv=3), 8, "num_key_value_heads=3 is fewer than the ranks and 8 is not a multiple of it"),
    (dict(heads=32, kv=8, intermediate=1000), 16, "intermediate_size=1000 is not divisible by 16"),
])
def test_splits_that_cannot_work_are_refused_with_the_numbers(shape, tp, words):
    with pytest.raises(ConfigError, match="--tensor-parallel-size") as info:
        _config(**shape).sharded(tp)
    assert words in str(info.value)


def test_config_check_refuses_before_any_process_starts(tmp_path):
    build_tiny_checkpoint("llama", tmp_path, num_layers=1)  # 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by 3"):
        Config.flat(model=str(tmp_path), tensor_parallel_size=3).check()
    assert Config.flat(model=str(tmp_path), tensor_parallel_size=2).check().num_heads == 2
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        Config.flat(tensor_parallel_size=0)
