# kvgw gateway image: `docker build -t kvgw .` (docker-compose.yml builds it for you).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY backends backends
COPY migrations migrations
COPY client client
RUN pip install --no-cache-dir ./client . && useradd --create-home kvgw && mkdir /data /shared && chown kvgw /data /shared
USER kvgw
VOLUME /data
EXPOSE 8080
ENTRYPOINT ["kvgw", "serve", "--host", "0.0.0.0", "--port", "8080", "--data-dir", "/data"]
