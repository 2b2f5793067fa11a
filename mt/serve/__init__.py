"""``mt-serve``: a translation server with a JSON API and a web page (``server``), decoding
requests that arrive together as one batch (``request_queue``)."""
