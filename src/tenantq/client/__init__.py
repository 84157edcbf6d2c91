"""The producer's side: `tenantq.Queue` and `tenantq.AsyncQueue`.

operations.py holds every method once, as steps (store/steps.py);
runner.py drives those steps on a sync or an async connection (tenantq's
pool, or the caller's own, inside the caller's transaction: connections.py);
listener.py is the one LISTEN connection per process behind `wait()`.
"""
