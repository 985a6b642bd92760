"""utils.transformer: the course's transformer (notebooks 09, 10 and 12) against PyTorch's own pieces, its weights
and data from the seed alone, and RoPE on global positions (what context parallelism relies on)."""
import pytest
import torch
import torch.nn.functional as F

from utils import transformer as tf

SIZES = tf.TransformerSizes()


def test_attention_equals_scaled_dot_product_attention():
    q, k, v = torch.randn(3, 2, 4, 7, 8, dtype=torch.float64).unbind()
    positions = torch.arange(7)
    for causal, mask in ((True, tf.causal_mask(positions, positions)), (False, None)):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(tf.attention(q, k, v, mask), expected, rtol=0, atol=1e-14)


def test_rms_norm_equals_torch():
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    ours, theirs = tf.RMSNorm(16).double(), torch.nn.RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        ours.weight.copy_(torch.randn(16))
        theirs.weight.copy_(ours.weight)
    assert torch.allclose(ours(x), theirs(x), rtol=0, atol=1e-14)


def test_rope_scores_depend_only_on_the_distance():
    q, k = torch.randn(2, 1, 6, 8, dtype=torch.float64).unbind()
    positions = torch.arange(6)
    scores = [tf.apply_rope(q, *tf.rope_angles(p, 8)) @ tf.apply_rope(k, *tf.rope_angles(p, 8)).transpose(-2, -1)
              for p in (positions, positions + 1000)]
    assert torch.allclose(scores[0], scores[1], rtol=0, atol=1e-9)
    unrotated = q @ k.transpose(-2, -1)
    assert not torch.allclose(scores[0], unrotated)


def test_a_chunk_of_queries_at_its_global_positions_gets_the_whole_sequences_rows():
    """What a context-parallel rank computes: its queries' rows of the output, from all keys, with global positions.
    With its local positions (0 .. chunk-1) instead, RoPE turns the queries by the wrong angles."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 4, 8, 8, dtype=torch.float64).unbind()
    positions = torch.arange(8)
    cos, sin = tf.rope_angles(positions, 8)
    whole = tf.attention(tf.apply_rope(q, cos, sin), tf.apply_rope(k, cos, sin), v, tf.causal_mask(positions,
                                                                                                      positions))
    keys = tf.apply_rope(k, cos, sin)
    for chunk, local in ((positions[4:], False), (positions[4:], True)):
        at = torch.arange(4) if local else chunk
        qc = tf.apply_rope(q[..., chunk, :], *tf.rope_angles(at, 8))
        out = tf.attention(qc, keys, v, tf.causal_mask(chunk, positions))
        assert torch.allclose(out, whole[..., chunk, :], rtol=0, atol=1e-13) is not local


def test_the_model_is_the_same_in_any_process_and_any_order():
    torch.manual_seed(1)
    a = tf.build_transformer(SIZES, seed=3)
    torch.manual_seed(2)
    torch.randn(10)
    b = tf.build_transformer(SIZES, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    c = tf.build_transformer(SIZES, seed=4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    draws = [p for name, p in a.named_parameters() if not name.endswith("norm.weight")]
    assert len({p.flatten()[0].item() for p in draws}) == len(draws)  # no two weights from one stream


def test_a_pipeline_stage_builds_its_layers_alone_with_the_whole_models_names_and_values():
    whole = tf.build_transformer(SIZES, seed=0)
    with torch.device("meta"):
        stage = tf.Transformer(SIZES)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage = tf.init_weights(stage.to_empty(device="cpu").double(), seed=0)
    names = dict(whole.named_parameters())
    assert all(torch.equal(p, names[name]) for name, p in stage.named_parameters())
    assert "layers.1.attention.wq.weight" in dict(stage.named_parameters())
    inputs, _ = tf.make_tokens(SIZES)
    hidden = whole.tok_embeddings(inputs)
    hidden = whole.layers["0"](hidden, torch.arange(SIZES.seq_len))
    assert torch.equal(stage(hidden), whole(inputs))


def test_parameter_names_are_torchtitans():
    names = [name for name, _ in tf.build_transformer(SIZES).named_parameters()]
    assert names[:3] == ["tok_embeddings.weight", "layers.0.attention_norm.weight", "layers.0.attention.wq.weight"]
    assert {"layers.1.feed_forward.w2.weight", "norm.weight", "output.weight"} <= set(names)


def test_tokens_come_from_the_step_and_targets_are_the_next_token():
    inputs, targets = tf.make_tokens(SIZES, seed=0, step=1)
    assert inputs.shape == targets.shape == (SIZES.batch_size, SIZES.seq_len)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(tf.make_tokens(SIZES, 0, 1)[0], inputs) and not torch.equal(tf.make_tokens(SIZES, 0, 2)[0],
                                                                                    inputs)


def test_the_reference_run_learns_and_is_deterministic():
    params, losses = tf.train_transformer_reference(SIZES, num_steps=4)
    again, losses_again = tf.train_transformer_reference(SIZES, num_steps=4)
    assert losses == losses_again and all(torch.equal(params[n], again[n]) for n in params)
    assert losses[0] == pytest.approx(torch.log(torch.tensor(64.0)).item(), rel=0.35)  # about uniform at first
    assert losses[-1] < losses[0]


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="dim 30 is not divisible by num heads 4"):
        tf.TransformerSizes(dim=30)
    with pytest.raises(ValueError, match="head dim 5 .* is odd: RoPE"):
        tf.TransformerSizes(dim=20, num_heads=4)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        tf.TransformerSizes(seq_len=2.0)
    with pytest.raises(TypeError, match="must be a TransformerSizes"):
        tf.build_transformer({"dim": 32})
