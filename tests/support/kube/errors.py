"""``ApiError``: a failed API call, answered as the Kubernetes ``Status`` body kubectl and kopf parse."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .resources import ResourceSpec


class ApiError(Exception):
    """A failed API call, answered as a Kubernetes ``Status`` with this HTTP code and reason."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code, self.reason, self.message, self.details = code, reason, message, details or {}

    def status(self) -> dict[str, Any]:
        """The ``Status`` body."""
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure"}
        body.update(message=self.message, reason=self.reason, code=self.code)
        if self.details:
            body["details"] = self.details
        return body

    @classmethod
    def not_found(cls, spec: ResourceSpec, name: str) -> ApiError:
        details = {"name": name, "group": spec.group, "kind": spec.plural}
        return cls(404, "NotFound", f'{spec.qualified} "{name}" not found', details)

    @classmethod
    def conflict(cls, spec: ResourceSpec, name: str) -> ApiError:
        message = (
            f'Operation cannot be fulfilled on {spec.qualified} "{name}": '
            "the object has been modified; please apply your changes to the latest version and try again"
        )
        return cls(409, "Conflict", message, {"name": name, "group": spec.group, "kind": spec.plural})

    @classmethod
    def invalid(cls, kind: str, name: str | None, field: str, message: str, group: str = "") -> ApiError:
        cause = {"reason": "FieldValueInvalid", "message": f"Invalid value: {message}", "field": field}
        details = {"name": name or "", "group": group, "kind": kind, "causes": [cause]}
        qualified = f"{kind}.{group}" if group else kind
        return cls(422, "Invalid", f'{qualified} "{name}" is invalid: {field}: Invalid value: {message}', details)
