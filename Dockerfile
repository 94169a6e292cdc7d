# The image the Kubernetes manifests run (ghcr.io/tensora/tensora): the control API, the controller
# with the Kubernetes driver, and the gateway; the same `tensora` command as on one machine.
# Not built on the machines this project is developed on (no container runtime there).
# Built in two stages: the full image has the C compiler that compiles the hot paths (setup.py, tensora.native);
# the image that runs has no compiler, only the wheel built with it. The build stage installs that wheel and fails
# unless both groups run compiled (why_pure says why not).
FROM python:3.11 AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && pip install --no-cache-dir --no-deps /wheels/tensora-*.whl \
 && cd / && python -c 'import sys, tensora.native as n; whys = {g: n.why_pure(g) for g in n.GROUPS}; \
print(whys); sys.exit(1 if any(whys.values()) else 0)'

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home tensora
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/tensora-*.whl)[kubernetes]" && rm -rf /wheels
USER 10001
WORKDIR /home/tensora
ENTRYPOINT ["tensora"]
CMD ["serve", "--help"]
