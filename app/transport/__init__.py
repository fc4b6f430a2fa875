"""The transports: how a caller reaches a session, shared by a single server and a front end (docs/SERVICE.md,
"Transports").

    access.py        who may be served: origin, then token → Caller (or AccessDenied)
    refusal.py       why a caller gets no session, as one transport-neutral value
    controls.py      the v1 control messages applied to a session, for any transport that carries them
    messages.py      server messages every transport words alike (a chunk's ``chunk``, ``rate_limited``)
    rest.py          the REST transport: ApiError, the one JSON error shape, a refusal as 503 / 429
    websocket.py     the socket transport: accept or close unaccepted, a refusal as ``error`` + ``closed`` +
                     close code, then one attached socket (media pump, control receiver)
    socket_input.py  the pictures and video a socket's client sends
    webrtc.py        the WebRTC transport: an SDP offer answered (or refused as REST refuses), then one peer
                     connection (tracks out, the v1 controls on a data channel, the camera in)
    webrtc_media.py  the peer's tracks: the session's frames and sound at their presentation times, the camera
"""
