"""Who may call the gateway: Bearer keys checked before any handler runs (pure ASGI middleware).

* ``/v1/*``: when data keys are configured (``--api-key``, ``KVROUTE_API_KEYS``), a valid
  ``Authorization: Bearer <key>`` is required; the admin key is accepted there too. Otherwise 401
  with an OpenAI error (``authentication_error`` / ``invalid_api_key``), so the request never
  reaches a replica.
* ``/admin/*``: the admin key (``--admin-key``, ``KVROUTE_ADMIN_KEY``) only; a valid data key gets
  403 (``permission_error``), a missing or wrong one 401. Without an admin key configured the
  admin API is disabled: 403.
* per data key, at most ``rate_limits`` on ``/v1`` (``gateway.rate_limit``; 429 above it);
  admin keys are not limited.
* ``/metrics``: open unless ``metrics_key_required`` (then any data or admin key works).
* everything else (``/health``, unknown paths): open.

Keys are read and compared by ``kvroute.auth`` (the rule replicas apply too). The verdict is
left in ``scope["kvroute.auth"]`` (``"admin"``, ``"data"`` or ``None``) for handlers such as the
admin policy override.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.rate_limit import KeyRateLimits
from kvroute.auth import bearer_token, key_matches, unauthorized
from kvroute.openai_api.errors import APIError

AUTH_SCOPE_KEY = "kvroute.auth"
ADMIN, DATA = "admin", "data"


def _is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class GatewayAuth:
    """The gateway's key checks; see the module docstring for the rules."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: Iterable[str] = (),
        admin_key: str | None = None,
        metrics_key_required: bool = False,
        rate_limits: KeyRateLimits | None = None,
    ) -> None:
        self.app = app
        self.rate_limits = rate_limits
        self.data_keys = tuple(k.encode() for k in api_keys)
        self.admin_keys = (admin_key.encode(),) if admin_key else ()
        self.metrics_key_required = metrics_key_required
        if metrics_key_required and not (self.data_keys or self.admin_keys):
            raise ValueError("--metrics-key-required needs --api-key or --admin-key")

    def role(self, token: bytes | None) -> str | None:
        # both checks always run: no early exit that would tell an admin key from a data key by time
        is_admin = key_matches(token, self.admin_keys)
        is_data = key_matches(token, self.data_keys)
        return ADMIN if is_admin else DATA if is_data else None

    def check(self, path: str, role: str | None, presented: bool) -> APIError | None:
        """The refusal for a request to ``path`` by ``role``, or None to let it through."""
        if _is_api(path):
            if self.data_keys and role is None:  # with only an admin key set, /v1 stays open
                return unauthorized(
                    "Incorrect API key provided."
                    if presented
                    else "Missing API key: send Authorization: Bearer <key>."
                )
            return None
        if path == "/admin" or path.startswith("/admin/"):
            if not self.admin_keys:
                return APIError(
                    "The admin API is off: start the gateway with --admin-key KEY (also `kvroute up"
                    " --admin-key KEY`) or the KVROUTE_ADMIN_KEY environment variable.",
                    403,
                    code="admin_disabled",
                )
            if role == ADMIN:
                return None
            if role == DATA:
                return APIError("This key may not use the admin API.", 403, code="insufficient_permissions")
            return unauthorized("Incorrect admin key provided." if presented else "Missing admin key.")
        if path == "/metrics" and self.metrics_key_required and role is None:
            return unauthorized("Incorrect API key provided." if presented else "Missing API key.")
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope["headers"])
        role = self.role(token)
        scope[AUTH_SCOPE_KEY] = role
        refusal = self.check(scope["path"], role, token is not None)
        if refusal is None and role == DATA and self.rate_limits is not None and _is_api(scope["path"]):
            assert token is not None
            refusal = self.rate_limits.refusal(token)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        response = refusal.to_response()
        if refusal.status == 401:
            response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)
