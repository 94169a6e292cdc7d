# The image the Kubernetes manifests run (ghcr.io/tensora/tensora): the control API, the controller
# with the Kubernetes driver, and the gateway; the same `tensora` command as on one machine.
# Not built on the machines this project is developed on (no container runtime there).
# Built in two stages: the full image has the C compiler that compiles admission's hot path (setup.py,
# tensora.native); the image that runs has no compiler, only the wheel built with it.
FROM python:3.11 AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home tensora
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/tensora-*.whl)[kubernetes]" && rm -rf /wheels
USER 10001
WORKDIR /home/tensora
ENTRYPOINT ["tensora"]
CMD ["serve", "--help"]
