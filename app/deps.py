"""Dependencies of the routes, as ``Annotated`` aliases: ``def route(server: ServerDep, caller: CallerDep)``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection, Request

from app.backend import Server, SessionsApi
from app.security import Caller
from app.service import Service
from app.settings import Settings
from app.transport.access import AccessDenied, identify
from app.transport.rest import ApiError


def _state(name: str):
    """A dependency reading ``app.state.<name>`` (set by the app factory or its lifespan)."""

    async def read(connection: HTTPConnection):
        return getattr(connection.app.state, name)

    return Depends(read)


# The process answering: a single server's service, or a front end (``app/backend.py``).
ServerDep = Annotated[Server, _state("service")]
# The same object where only a single server has the route (``internal``).
ServiceDep = Annotated[Service, _state("service")]
SessionsDep = Annotated[SessionsApi, _state("sessions")]
SettingsDep = Annotated[Settings, _state("settings")]


async def rest_caller(request: Request, settings: SettingsDep) -> Caller:
    """The REST caller: a browser page from a foreign origin is refused (no CSRF of sessions), and with a
    token configured, ``Authorization: Bearer`` must carry it."""
    try:
        return identify(request, settings)
    except AccessDenied as denied:
        raise ApiError.denied(denied) from None


CallerDep = Annotated[Caller, Depends(rest_caller)]
