"""The process: the command line, the daemon's wiring, ``bumblebot check``, the systemd
service and notifications, the event-loop watchdog."""
