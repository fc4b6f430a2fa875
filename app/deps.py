"""Dependencies of the routes, as ``Annotated`` aliases: ``def route(server: ServerDep, caller: CallerDep)``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from starlette.requests import HTTPConnection, Request

from app.backend import Server, SessionsApi
from app.routes import ApiError
from app.security import Caller, Unauthorized, authenticate, bearer_from_header, client_address, origin_allowed
from app.service import Service
from app.settings import Settings


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
    if not origin_allowed(request.headers.get("origin"), request.headers.get("host"), settings):
        raise ApiError(403, "forbidden_origin", "this origin may not use the API")
    try:
        principal = authenticate(bearer_from_header(request.headers), settings)
    except Unauthorized as error:
        raise ApiError(401, "unauthorized", str(error), headers={"WWW-Authenticate": "Bearer"}) from None
    return Caller(principal=principal, address=client_address(request.scope))


CallerDep = Annotated[Caller, Depends(rest_caller)]
