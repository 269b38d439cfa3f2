"""The progress bar keeps the latest logged figures; metrics.jsonl drops records past a resume."""

import json

from dflash_train.train.watch.metrics import MetricsLog


def test_bar_keeps_the_logged_loss_between_log_steps(tmp_path):
    log = MetricsLog(tmp_path, total_steps=10, start_step=0, enabled=True, tensorboard=False)
    log.advance(1, {"loss": "2.500", "acc1": "0.31"})
    for _ in range(3):
        log.advance(1)  # steps that log nothing
    assert log.bar.n == 4
    assert "loss=2.500" in log.bar.postfix and "acc1=0.31" in log.bar.postfix
    log.close()


def test_resume_truncates_records_after_the_checkpoint_step(tmp_path):
    log = MetricsLog(tmp_path, total_steps=10, start_step=0, enabled=True, tensorboard=False)
    for step in range(1, 7):
        log.log({"step": step, "loss": float(step)})
    log.close()
    resumed = MetricsLog(tmp_path, total_steps=10, start_step=4, enabled=True, tensorboard=False)
    resumed.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_the_bar_s_total_follows_a_time_budget_s_decision(tmp_path):
    log = MetricsLog(tmp_path, total_steps=13260, start_step=0, enabled=True, tensorboard=False)
    log.advance(30)
    log.set_total(2433)  # the gpu recipe: 30 epochs planned, 3.5 minutes allow ~2,400 steps
    assert log.bar.total == 2433 and "30/2433" in str(log.bar)
    log.close()
