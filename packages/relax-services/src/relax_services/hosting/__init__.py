"""Where services run: the local Ray instance, the reaper of its processes, each worker's setup hook, the host
process of one or more services (co-hosting) and the light process that serves the queues, weight store and
health monitor."""
