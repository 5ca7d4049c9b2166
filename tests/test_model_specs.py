"""Model specs as users type them: a misspelled key or a value of the wrong type is a
one-line UsageError naming the key (and the closest valid one) instead of a model
silently built from defaults; a sequence longer than the model's positions is refused
before anything is built."""

from __future__ import annotations

import pytest

from oomguard.engine.errors import UsageError
from oomguard.metrics.models import check_seq_len, model_config


@pytest.mark.parametrize("spec, named", [
    ("gpt2:n_layr=1", ["'n_layr' (did you mean 'n_layer'?)"]),
    ("gpt_neox:num_layers=1,hidden_size=64,vocab_sise=64",
     ["'num_layers' (did you mean 'num_hidden_layers'?)", "'vocab_sise' (did you mean "
      "'vocab_size'?)"]),
    ("llama:num_hidden_layer=2", ["'num_hidden_layer' (did you mean 'num_hidden_layers'?)"]),
])
def test_an_unknown_key_names_itself_and_the_closest_valid_key(spec, named):
    with pytest.raises(UsageError) as info:
        model_config(spec)
    message = str(info.value)
    assert "\n" not in message and "has no config key" in message
    for part in named:
        assert part in message


@pytest.mark.parametrize("spec, words", [
    ("gpt2:n_layer=abc", ["n_layer", "expected int", "'abc'"]),
    ("gpt2:n_layer=1.5", ["n_layer", "expected int", "1.5"]),
])
def test_a_value_of_the_wrong_type_is_one_line(spec, words):
    with pytest.raises(UsageError) as info:
        model_config(spec)
    message = str(info.value)
    assert "\n" not in message and spec in message
    assert all(w in message for w in words)


def test_aliases_and_keys_a_config_consumes_are_accepted():
    assert model_config("gpt2:num_hidden_layers=3,hidden_size=64,n_head=4").n_layer == 3
    # transformers 5 folds LLaMA's legacy rope_theta into rope_parameters
    llama = model_config("llama:rope_theta=500000.0,num_hidden_layers=1")
    assert llama.rope_parameters["rope_theta"] == 500000.0
    assert model_config("gpt2:use_cache=false,pad_token_id=0").pad_token_id == 0


def test_a_sequence_longer_than_the_positions_is_refused_naming_the_key():
    gpt2 = model_config("tiny-gpt2")
    check_seq_len(gpt2, 1024)
    with pytest.raises(UsageError, match=r"1025 is longer than the model's 1024 positions "
                                         r"\(n_positions\).*gpt2:n_positions=1025"):
        check_seq_len(gpt2, 1025)
    with pytest.raises(UsageError, match="max_position_embeddings"):
        check_seq_len(model_config("tiny-llama"), 4096)
    check_seq_len(model_config("bloom:n_layer=1"), 10**6)  # ALiBi: no declared limit


@pytest.mark.parametrize("value", ["[" * 100_000, "[" * 50 + "]" * 50 + "x" * 5000])
def test_a_hostile_value_or_a_spec_too_long_for_a_file_name_is_one_line(value):
    # 100,000 brackets overflowed json's recursion; 5,000 characters overflowed the file
    # name the spec was first tried as (a checkpoint folder)
    with pytest.raises(UsageError) as info:
        model_config(f"gpt2:n_embd={value}")
    assert "\n" not in str(info.value) and "fix the spec" in str(info.value)
