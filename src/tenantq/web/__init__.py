"""The web dashboard (`tenantq dashboard`): server-rendered pages over the
read API of `tenantq.Queue`; see `tenantq.web.app`."""

from tenantq.web.app import create_app, serve

__all__ = ["create_app", "serve"]
