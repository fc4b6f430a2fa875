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


async def get_server(connection: HTTPConnection) -> Server:
    """The process answering: a single server's service, or a front end (``app/backend.py``)."""
    return connection.app.state.service


ServerDep = Annotated[Server, Depends(get_server)]


async def get_service(connection: HTTPConnection) -> Service:
    """A single server's service (routes only a single server has: ``internal``)."""
    return connection.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]


async def get_sessions(connection: HTTPConnection) -> SessionsApi:
    return connection.app.state.sessions


SessionsDep = Annotated[SessionsApi, Depends(get_sessions)]


async def get_settings(connection: HTTPConnection) -> Settings:
    return connection.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


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
