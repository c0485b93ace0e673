"""Chat templates, tool-call and reasoning formats, typed output pieces."""
