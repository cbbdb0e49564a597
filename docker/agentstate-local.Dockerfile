# agentstate around a static binary built on the host, FROM scratch, for
# machines that cannot pull a base image. See the top-level Dockerfile for
# the multi-stage build users run where a registry is reachable.
FROM scratch
COPY agentstate /agentstate
ENV HOME=/home/agent XDG_STATE_HOME=/state
ENTRYPOINT ["/agentstate"]
