"""Example training jobs run through the memory box (``smb train``)."""
