"""Start the agent without running the tenantq package's __init__.

`python -m tenantq.guest.agent` imports the whole tenantq package first
(its registry, asyncio, ssl, the store's models): ~0.3 s of every cold boot
under gVisor, for an agent that uses only the standard library and the
guest modules. The host runs this file by path instead (boot.agent_argv:
`python -S -P .../tenantq/guest/start_agent.py ARGS`; -P keeps this
directory off sys.path), and it installs `tenantq` and `tenantq.guest` as
bare packages whose __path__ is their directory, so importing
`tenantq.guest.agent` loads only the guest modules it names. Only the
agent's own process sees the bare packages: every command it runs, the
job runner it hands over to included, is a new interpreter.
"""

import os
import sys
import types


def _bare_package(name: str, directory: str) -> None:
    package = types.ModuleType(name, "a bare package: see tenantq/guest/start_agent.py")
    package.__path__ = [directory]
    sys.modules[name] = package


if __name__ == "__main__":
    guest_dir = os.path.dirname(os.path.realpath(__file__))
    _bare_package("tenantq", os.path.dirname(guest_dir))
    _bare_package("tenantq.guest", guest_dir)
    from tenantq.guest.agent import main

    sys.exit(main(sys.argv[1:]))
