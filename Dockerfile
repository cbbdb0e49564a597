# agentstate for users: a multi-stage build into a static, non-root image.
#   docker build -t agentstate .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o /out/agentstate ./cmd/agentstate \
 && mkdir -p /out/state /out/home && chown 65532:65532 /out/state /out/home

FROM scratch
COPY --from=build /out/agentstate /agentstate
COPY --from=build --chown=65532:65532 /out/state /state
COPY --from=build --chown=65532:65532 /out/home /home/agent
ENV HOME=/home/agent XDG_STATE_HOME=/state
USER 65532:65532
ENTRYPOINT ["/agentstate"]
