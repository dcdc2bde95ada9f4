"""The status page an operator opens in a browser (``GET /ui``).

==============  ======================================================================
``routes``      :class:`StatusPage`: the page's files, ``/`` → ``/ui``, and
                ``GET /admin/history`` (scope metrics) that the page polls
``history``     the bounded ring (a sample every 2 s for an hour, the last events)
``sampler``     the task that feeds it from status snapshots and the audit trail
``events``      pure: the events between two snapshots, and an audit line as one
``static/``     ``index.html``, ``app.js``, ``app.css``: hand-written, no build step
==============  ======================================================================
"""

from appliance.gateway.observe.ui.routes import StatusPage

__all__ = ["StatusPage"]
