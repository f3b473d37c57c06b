"""Pictures and pages: an HTML page (``html``), matplotlib figures (``plots``) and a traced
step's memory over time (``timeline``). They read values computed below; they compute none."""
