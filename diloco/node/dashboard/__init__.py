"""``diloco-node dashboard``: a read-only peer that follows a run and serves a live page.

``follower`` reads the run's signed node and metrics records from the DHT every few
seconds into a ``view``; ``server`` serves the page (``page.html``, ``dashboard.js``:
plain SVG charts, no library, nothing fetched from elsewhere) and its JSON endpoints.
"""
