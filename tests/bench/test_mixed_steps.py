"""bench/mixed_steps.py on the CPU at the tiny shape: every step kind runs eagerly and piecewise, the
piecewise steps give the eager graph's logits on the same padded step, the one beyond the largest bucket
runs eagerly."""

import mixed_steps


def test_the_mixed_step_table_on_the_cpu(capsys):
    rows = mixed_steps.main(["--shape", "tiny", "--device", "cpu", "--steps", "1"])
    assert [(r.kind, r.path, r.bucket) for r in rows] == [
        (kind.name, path, bucket) for kind, bucket in zip(mixed_steps.CPU_KINDS, (4, 16, 16, None))
        for path in ("eager", "piecewise")]
    for row in rows:
        assert row.host_ms > 0 and row.step_ms > 0 and row.device_ms is None
        if row.path == "piecewise":
            assert row.same_tokens == row.seqs
            assert row.difference == (0.0 if row.bucket else None)
    out = capsys.readouterr().out
    assert "piecewise: 3 pieces x 3 token buckets (4-32), 3 eager parts between them, 9 captures" in out
    assert "mixed 4 decodes + 1x9 on 8" in out and "0, 5/5 tokens" in out
    assert "largest logit difference 0 (" in out
