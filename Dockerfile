# The image the Kubernetes manifests run (ghcr.io/tensora/tensora): the control API, the controller
# with the Kubernetes driver, and the gateway; the same `tensora` command as on one machine.
# Not built on the machines this project is developed on (no container runtime there).
FROM python:3.11-slim
RUN useradd --uid 10001 --create-home tensora
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir '.[kubernetes]' && rm -rf /src
USER 10001
WORKDIR /home/tensora
ENTRYPOINT ["tensora"]
CMD ["serve", "--help"]
