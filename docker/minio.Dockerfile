# The pinned MinIO server, FROM scratch, built locally (no registry needed):
# scripts/build-images puts the static minio and agentstate binaries in the
# build context. agentstate is there for the health check (`agentstate probe`).
FROM scratch
COPY minio /minio
COPY agentstate /agentstate
VOLUME /data
EXPOSE 9000 9001
ENTRYPOINT ["/minio"]
