"""The adversarial app plus the cancel attacks (tests/adversarial/test_cancel.py):
every handler of tests/adversarial/attack_app.py (`adv.echo` among them) and
the `cancel.*` ones of tests/adversarial/attacks/cancel_attacks.py. Stdlib only
(it runs in the guest)."""

from __future__ import annotations

from tests.adversarial import attack_app  # noqa: F401  (registers the adv.* handlers)
from tests.adversarial.attacks import cancel_attacks  # noqa: F401  (registers the cancel.* handlers)
