"""The hostile handlers of tests/adversarial/attack_app.py, by the rule they attack."""
